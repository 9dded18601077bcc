"""Every failure a user can cause: one `error:` line that names the flag or file and the fix, the exit code of the
failure page (docs/failures.md), no traceback, no partial file left, and no log where the run's checks refused it (its
run id stays free); the same line at the end of the log of a run that passed them.

Most cases call train_gpt.main() in this process (they fail before anything trains, in well under a second); the
signal cases and one end-to-end case run the script in a subprocess, as a user would.
"""
import builtins
import os
import re
import signal
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
import torch

import checks
import train_gpt as tg
import harness  # noqa: E402
from _shards import BOS, CPU_MALLOC_ENV, ROOT, make_dataset, structured_docs, write_shard

SHORT = ["--preset=tiny", "--num_scheduled_iterations=6", "--num_extension_iterations=0", "--warmup=false",
         "--val_loss_every=0", "--seed=0"]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    d = tmp_path_factory.mktemp("data")
    return make_dataset(d, train_tokens=300_000, val_tokens=20_000)


def run_main(capsys, args, tmp_path, run_id="run"):
    """main() in this process; returns (exit code, stderr's lines, stdout, the log's lines or None)."""
    code = tg.main([*args, f"--log_dir={tmp_path}/logs", f"--run_id={run_id}"])
    out, err = capsys.readouterr()
    log = tmp_path / "logs" / f"{run_id}.txt"
    assert not leftovers(tmp_path), leftovers(tmp_path)
    return code, err.splitlines(), out, (log.read_text().splitlines() if log.exists() else None)


def assert_one_error(code, err, want_code, *needles):
    """The exit code, exactly one stderr line and it is `error: ...` holding every needle, no traceback."""
    assert code == want_code, (code, err)
    assert len(err) == 1 and err[0].startswith("error: "), err
    assert "Traceback" not in "\n".join(err)
    for needle in needles:
        assert needle in err[0], (needle, err[0])


def leftovers(folder):
    """Temporary or partial files a failure must not leave."""
    return [p for p in Path(folder).rglob("*") if ".tmp" in p.name or ".write_test" in p.name]


# ---- data ---------------------------------------------------------------------------------------------------------

def shard_with(tmp_path, tokens, name="fineweb_train_000001.bin"):
    d = tmp_path / "bad"
    d.mkdir(exist_ok=True)
    return write_shard(d / name, tokens)


@pytest.mark.parametrize("where", ["sample", "past_the_sample"])
def test_token_ids_outside_the_vocabulary(capsys, tmp_path, data, where):
    """An id >= --vocab_size: in the sample preflight reads, or far into the shard, where the loader's check of each
    shard it loads catches it at the first batch (not a device-side assert mid-run)."""
    toks = structured_docs(checks.PREFLIGHT_SAMPLE_TOKENS + 300_000, 3)
    pos = 5_000 if where == "sample" else checks.PREFLIGHT_SAMPLE_TOKENS + 1_000
    toks[pos] = 60_000
    bad = shard_with(tmp_path, toks)
    code, err, _, log = run_main(capsys, [*SHORT, f"--train_files={bad}", f"--val_files={data[1]}"], tmp_path)
    assert_one_error(code, err, 1, "token id 60000", f"token {pos:,}", "fineweb_train_000001.bin", "--vocab_size")
    if where == "sample":                             # refused by the checks: no log keeps the run id
        assert log is None
    else:                                             # found by the loader, once training began
        assert log[-1] == err[0]                      # the log ends with the line the console got
        assert any(line.startswith("phase:process_start_to_timed_loop") for line in log)


def test_token_ids_outside_the_vocabulary_in_the_val_shard_fail_before_training(capsys, tmp_path, data):
    """With --val_loss_every=0 the val shard is first read after the last step: preflight reads it all first."""
    toks = structured_docs(20_000, 1)
    toks[4_000] = 50_304
    bad = shard_with(tmp_path, toks, "fineweb_val_000000.bin")
    code, err, _, log = run_main(capsys, [*SHORT, f"--train_files={data[0]}", f"--val_files={bad}"], tmp_path)
    assert_one_error(code, err, 1, "token id 50304", "fineweb_val_000000.bin")
    assert log is None                                # refused before training: no log keeps the run id


def test_shard_without_a_document_start(capsys, tmp_path, data):
    toks = structured_docs(300_000, 2)
    toks[toks == BOS] = 7
    bad = shard_with(tmp_path, toks)
    code, err, _, log = run_main(capsys, [*SHORT, f"--train_files={bad}", f"--val_files={data[1]}"], tmp_path)
    assert_one_error(code, err, 1, "no document start", "fineweb_train_000001.bin", "data/tokenize_docs.py")
    assert log is None                                # refused by the checks: no log keeps the run id


def test_folder_matched_by_the_shard_glob(capsys, tmp_path, data):
    d = Path(data[0]).parent
    (d / "fineweb_train_999999.bin").mkdir(exist_ok=True)
    try:
        code, err, _, _ = run_main(capsys, [*SHORT, f"--train_files={data[0]}", f"--val_files={data[1]}"], tmp_path)
    finally:
        (d / "fineweb_train_999999.bin").rmdir()
    assert_one_error(code, err, 1, "matches the folder", "fineweb_train_999999.bin")


def test_broken_symlink_matched_by_the_shard_glob(capsys, tmp_path, data):
    link = tmp_path / "fineweb_train_000001.bin"
    os.symlink(tmp_path / "gone.bin", link)
    code, err, _, _ = run_main(capsys, [*SHORT, f"--train_files={tmp_path}/fineweb_train_*.bin",
                                        f"--val_files={data[1]}"], tmp_path)
    assert_one_error(code, err, 1, "broken symbolic link", str(link))


def test_shard_the_process_cannot_read(capsys, tmp_path, data, monkeypatch):
    """chmod cannot take read access from root (CI runs as root), so open() refuses this one file instead."""
    bad = shard_with(tmp_path, structured_docs(300_000, 2))
    real_open = builtins.open

    def refusing_open(path, *args, **kwargs):
        if str(path) == bad:
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", refusing_open)
    code, err, _, _ = run_main(capsys, [*SHORT, f"--train_files={bad}", f"--val_files={data[1]}"], tmp_path)
    assert_one_error(code, err, 1, "cannot read shard", "permission denied", "chmod")


def step_walk_guard(monkeypatch):
    """stage_index (every per-step schedule function calls it) with a budget: a check that walks the steps stops with
    an error at once instead of running for minutes (83 s at 10^8 steps before issue 56)."""
    calls = {"n": 0}
    stage_index = tg.stage_index

    def counted(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] > 1000:
            raise AssertionError("a check walks the steps")
        return stage_index(*args, **kwargs)
    monkeypatch.setattr(tg, "stage_index", counted)


@pytest.mark.parametrize("dry", [False, True])
def test_a_billion_steps_is_refused_by_the_data_check_without_walking_them(capsys, tmp_path, data, monkeypatch, dry):
    step_walk_guard(monkeypatch)
    code, err, _, _ = run_main(capsys, [*SHORT, *(["--dry_run"] if dry else []),
                                        "--num_scheduled_iterations=1000000000", f"--train_files={data[0]}",
                                        f"--val_files={data[1]}"], tmp_path)
    assert_one_error(code, err, 1, "the schedule trains on", "--num_scheduled_iterations")


@pytest.mark.parametrize("how", ["glob", "symlink", "copy", "big_copy"])
@pytest.mark.parametrize("dry", [False, True])
def test_train_and_val_files_that_overlap_are_refused_naming_both(capsys, tmp_path, data, how, dry):
    """A --train_files glob that also matches the val shard (the dry run used to count it as a train shard), a link
    to it, or a copy of it (same size and content digest; a >2 MiB copy is told by its first and last MiB)."""
    d = tmp_path / "shards"
    d.mkdir()
    val = Path(data[1].replace("*", "000000"))
    train = write_shard(d / "fineweb_train_000001.bin", structured_docs(300_000, 9))
    train_glob = str(d / "fineweb_*.bin")
    if how == "big_copy":
        val = Path(write_shard(d / "val.bin", structured_docs(1_200_000, 8)))
    if how == "glob":
        (d / "fineweb_val_000000.bin").write_bytes(val.read_bytes())
        val_glob = named = str(d / "fineweb_val_*.bin")
    else:
        train_glob = str(d / "fineweb_train_*.bin")
        dup = d / "fineweb_train_000002.bin"
        os.symlink(val, dup) if how == "symlink" else dup.write_bytes(val.read_bytes())
        val_glob, named = str(val), str(dup)
    code, err, _, _ = run_main(capsys, [*SHORT, *(["--dry_run"] if dry else []), f"--train_files={train_glob}",
                                        f"--val_files={val_glob}"], tmp_path)
    assert_one_error(code, err, 1, named, str(val) if how != "glob" else named, "validate on tokens it trained on")
    assert train not in err[0]


def test_same_sized_train_and_val_shards_with_other_tokens_pass(tmp_path):
    d = tmp_path
    a = write_shard(d / "a.bin", structured_docs(50_000, 1))
    b = write_shard(d / "b.bin", structured_docs(50_000, 2))
    checks.check_disjoint_shards([a], [b], "a.bin", "b.bin")


# ---- options ------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("arg,needles", [
    ("--val_tokens=0", ["--val_tokens=0 must be positive"]),
    ("--model_dim=-128", ["--model_dim=-128 must be positive"]),
    ("--num_heads=0", ["--num_heads=0 must be positive"]),
    ("--batch_slices=0", ["--batch_slices=0 must be positive"]),
    ("--block_size=0", ["--block_size=0 must be positive"]),
    ("--adam_lr=-0.1", ["--adam_lr=-0.1 must be >= 0"]),
    ("--muon_lr=nan", ["--muon_lr='nan' is not a finite float"]),
    ("--num_extension_iterations=-1", ["--num_extension_iterations=-1 must be >= 0"]),
    ("--stages=0:1:3:1:1:128,768:1:3:1:1:256", ["stage 1 of --stages (0:1.0:3:1.0:1.0:128:0.0:0.0) needs a positive batch"]),
    ("--cooldown_frac=0", ["--cooldown_frac=0.0 must be in (0, 1]"]),
    ("--muon_beta2=1", ["--muon_beta2=1.0 must be in [0, 1)"]),
    ("--momentum_min=0.99", ["--momentum_min (0.99) <= --momentum_max (0.95)"]),
    ("--seed=-5", ["--seed=-5"]),
    ("--run_id=a/b", ["--run_id='a/b'"]),
    ("--run_id=x\nresult: val_loss:1.0 reached:yes", ["--run_id='x\\nresult", "letters, digits"]),  # no forged line
    ("--run_id=" + "x" * 201, ["at most 200"]),                                  # a file name has 255 bytes
    (f"--seed={2**63}", [f"--seed={2**63}: use -1 (unseeded) or a seed 0 .. 2**63 - 1"]),
    (f"--pg_timeout_s={10**15}", [f"--pg_timeout_s={10**15} must be 1 .. 10**9"]),
    ("--attn_backend=varlen", ["--attn_backend=varlen cannot run on cpu", "available: sdpa"]),
    ("--attn_backend=magic", ["--attn_backend=magic is not one of auto"]),
    ("--dtype=float16", ["--dtype=float16"]),
    ("--use_fp8=true", ["--use_fp8=false with --dtype"]),
    ("--lr=0.1", ["unknown option --lr; did you mean --adam_lr, --muon_lr"]),
    ("--num_layers", ["--num_layers needs a value"]),
    ("--profile_steps=5:99", ["--profile_steps='5:99'"]),
])
def test_bad_option_values_name_the_flag(capsys, tmp_path, data, arg, needles):
    extra = ["--dtype=float64"] if arg == "--use_fp8=true" else []
    run_id = arg.split("=", 1)[1] if arg.startswith("--run_id=") else "run"
    code, err, _, log = run_main(capsys, [*SHORT, *extra, f"--train_files={data[0]}", f"--val_files={data[1]}",
                                          arg], tmp_path, run_id=run_id)
    assert_one_error(code, err, 2, *needles)
    assert log is None                                # refused before training: no log keeps the run id


@pytest.mark.parametrize("env,needle", [
    ({"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0"}, "WORLD_SIZE=2 is set but MASTER_ADDR, MASTER_PORT are not"),
    ({"WORLD_SIZE": "2", "RANK": "2"}, "RANK=2 is not a rank of WORLD_SIZE=2"),
    ({"WORLD_SIZE": "two"}, "must be integers"),
])
def test_torchrun_variables_without_torchrun(capsys, tmp_path, data, monkeypatch, env, needle):
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    code, err, _, _ = run_main(capsys, [*SHORT, f"--train_files={data[0]}", f"--val_files={data[1]}"], tmp_path)
    assert_one_error(code, err, 2, needle, "./run.sh")


def test_a_bad_option_under_torchrun_is_reported_by_rank_0_alone_and_left_for_run_sh(capsys, tmp_path, monkeypatch):
    """Every process torchrun starts parses the same options before the process group exists: rank 0 alone prints
    the error line (not one per process), and each leaves its exit code where run.sh reads it."""
    monkeypatch.setenv("RUN_SH_EXIT_DIR", str(tmp_path))
    for rank in (0, 1):
        for name, value in (("RANK", rank), ("LOCAL_RANK", rank), ("WORLD_SIZE", 2)):
            monkeypatch.setenv(name, str(value))
        assert tg.main(["--bogus=1"]) == 2
        out, err = capsys.readouterr()
        assert err.splitlines() == (["error: unknown option --bogus; python3 train_gpt.py --help lists them"]
                                    if rank == 0 else []), (rank, err)
        assert (tmp_path / f"rank{rank}").read_text() == "2\n"


def test_help_lists_every_field_with_its_default_and_exits_0(capsys):
    for flag in ("--help", "-h"):
        assert tg.main([flag]) == 0
        out = capsys.readouterr().out
        assert out.startswith("usage: python3 train_gpt.py")
        for f in tg.dataclasses.fields(tg.Hyperparameters):
            assert f"  --{f.name}  [" in out, f.name
        assert "  --muon_lr  [float, default 0.023]  NorMuon base lr" in out
        assert "tiny: --model_dim=128" in out


# ---- files --------------------------------------------------------------------------------------------------------

def test_log_folder_that_cannot_be_created(capsys, tmp_path, data):
    (tmp_path / "file").write_text("not a folder")
    code = tg.main([*SHORT, f"--train_files={data[0]}", f"--val_files={data[1]}", f"--log_dir={tmp_path}/file/logs"])
    err = capsys.readouterr().err.splitlines()
    assert_one_error(code, err, 2, "cannot write to", "file/logs", "--log_dir")


def test_checkpoint_folder_is_write_tested_before_training(capsys, tmp_path, data):
    """--save_checkpoint used to train to the end and then crash on an unwritable folder, losing the run."""
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "ck").write_text("a file where the checkpoint folder goes")
    code, err, _, log = run_main(capsys, [*SHORT, "--save_checkpoint", f"--train_files={data[0]}",
                                          f"--val_files={data[1]}"], tmp_path, run_id="ck")
    assert_one_error(code, err, 2, "cannot write to", "logs/ck")
    assert log is None and not leftovers(tmp_path / "logs")


def test_reused_run_id_never_touches_the_earlier_log(capsys, tmp_path, data):
    (tmp_path / "logs").mkdir()
    earlier = tmp_path / "logs" / "mine.txt"
    earlier.write_text("an earlier run's log\n")
    code, err, _, _ = run_main(capsys, [*SHORT, f"--train_files={data[0]}", f"--val_files={data[1]}"], tmp_path,
                               run_id="mine")
    assert_one_error(code, err, 2, "mine.txt exists", "choose another --run_id")
    assert earlier.read_text() == "an earlier run's log\n"


@pytest.mark.parametrize("args", [["--save_checkpoint"], ["--checkpoint_every=2"], ["--save_checkpoint", "--dry_run"]])
def test_a_refused_run_leaves_no_empty_folder(capsys, tmp_path, data, args):
    """The checkpoint folder is made (and write-tested) before the data checks; a run they refuse, or a dry run,
    removes it again, and the refused run its log: the log folder is left empty."""
    code, err, _, log = run_main(capsys, [*SHORT, *args, "--val_tokens=1048576", f"--train_files={data[0]}",
                                          f"--val_files={data[1]}"], tmp_path)
    assert_one_error(code, err, 1, "validation reads 1,048,576 tokens")
    assert [p.name for p in (tmp_path / "logs").iterdir()] == []


def test_a_start_refused_by_its_checks_leaves_its_run_id_free(capsys, tmp_path, data):
    """A start its checks refuse (here: the validation asks for more tokens than the shards hold) trained nothing and
    its one console line says what its log would: it leaves no log, so the corrected command may take the same
    --run_id (the dry run makes the run's own check of the log path, without training)."""
    args = [*SHORT, f"--train_files={data[0]}", f"--val_files={data[1]}"]
    code, err, _, log = run_main(capsys, [*args, "--val_tokens=1048576"], tmp_path, run_id="mine")
    assert_one_error(code, err, 1, "validation reads 1,048,576 tokens")
    assert log is None
    code, err, out, _ = run_main(capsys, [*args, "--dry_run"], tmp_path, run_id="mine")
    assert code == 0 and err == [] and f"the log would be {tmp_path}/logs/mine.txt" in out, err


def test_a_failed_runs_log_keeps_its_run_id_and_the_refusal_says_how_to_continue(capsys, tmp_path, data):
    """A run that passed its checks keeps its log, also when it fails before its first step (here the loader finds
    a token id outside the vocabulary, past the sample the checks read): its explicit --run_id is not reused, and the
    refusal says how that run ended and the ways on: another --run_id, moving the log away, or resuming its
    states."""
    toks = structured_docs(checks.PREFLIGHT_SAMPLE_TOKENS + 300_000, 3)
    toks[checks.PREFLIGHT_SAMPLE_TOKENS + 1_000] = 60_000
    args = [*SHORT, f"--train_files={shard_with(tmp_path, toks)}", f"--val_files={data[1]}"]
    code, err, _, log = run_main(capsys, args, tmp_path, run_id="mine")
    assert code == 1 and log[-1] == err[0]
    code, err, _, _ = run_main(capsys, args, tmp_path, run_id="mine")
    assert_one_error(code, err, 2, "mine.txt exists", f"--run_id=mine failed ({log[-1][:40]}",
                     "its log is kept", "choose another --run_id", "move that log away to reuse this one")
    assert "--resume" not in err[0]
    (tmp_path / "logs" / "mine").mkdir()
    (tmp_path / "logs" / "mine" / "state_step000004.pt").write_bytes(b"a state")
    code, err, _, _ = run_main(capsys, args, tmp_path, run_id="mine")
    assert_one_error(code, err, 2, "mine.txt exists", f"--resume={tmp_path / 'logs' / 'mine'}")
    assert (tmp_path / "logs" / "mine.txt").read_text().splitlines() == log


# ---- signals ------------------------------------------------------------------------------------------------------

def start(args, cwd):
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONUNBUFFERED="1", **CPU_MALLOC_ENV)
    return subprocess.Popen([sys.executable, str(ROOT / "train_gpt.py"), *args], cwd=cwd, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def wait_for_line(proc, prefix, timeout=600):
    deadline = time.time() + timeout
    for line in proc.stdout:
        if line.startswith(prefix) or time.time() > deadline:
            return line
    return None


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("sig,code", [(signal.SIGINT, 130), (signal.SIGTERM, 143), (signal.SIGHUP, 129)])
def test_signal_in_the_timed_loop_stops_at_a_step_and_saves_it(tmp_path, data, sig, code):
    args = ["--preset=tiny", "--warmup=false", "--val_loss_every=0", "--seed=0", "--save_checkpoint",
            f"--train_files={data[0]}", f"--val_files={data[1]}", f"--log_dir={tmp_path}/logs", "--run_id=sig"]
    proc = start(args, tmp_path)
    assert wait_for_line(proc, "step:2/") is not None
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=600)
    name = signal.Signals(sig).name
    assert proc.returncode == code, err
    assert "Traceback" not in err
    errors = [l for l in err.splitlines() if l.startswith("error:")]
    assert len(errors) == 1 and f"stopped by {name} after step" in errors[0], err
    step = int(errors[0].split("after step ")[1].split()[0])
    saved = tmp_path / "logs" / "sig" / f"state_step{step:06d}.pt"
    assert errors[0].endswith(f"--resume={saved}")                 # this run's state, by name
    state = torch.load(saved, weights_only=False)                  # complete: it loads
    assert state["step"] == step and not leftovers(tmp_path / "logs")
    log = (tmp_path / "logs" / "sig.txt").read_text().splitlines()
    assert log[-1] == errors[0] and f"step:{step}/" in "\n".join(log)


class _Trainer:
    """What the timed loop uses of a Trainer, with no model: a state is its step, a step's loss is 1, and a signal can
    be sent to this process during a given step or during the final validation."""

    def __init__(self, hp, signal_in_step=None, signal_in_final_validation=False):
        self.hp, self.done = hp, 0
        self.signal_in_step, self.signal_in_final_validation = signal_in_step, signal_in_final_validation

    def state(self, steps_done, train_ms):
        return {"step": steps_done}

    def advance_schedule(self, sched):
        return None

    def train_step(self, sched, message):
        if sched.step == self.signal_in_step:
            os.kill(os.getpid(), signal.SIGINT)                     # deferred to the step's boundary
        self.done += 1
        return torch.ones(())

    def validate(self, ws_short, ws_long, stop=None):
        if self.signal_in_final_validation and self.done == self.hp.num_iterations:
            os.kill(os.getpid(), signal.SIGINT)                     # no boundary follows: the handler raises
        return 3.5


class _ValidatingTrainer(_Trainer):
    """The same, with a validation of real batches (tg.Trainer.validate over a stand-in model): a signal arrives
    during the validation after step `signal_in_validation_after`, at its second batch."""

    def __init__(self, hp, signal_in_validation_after):
        super().__init__(hp)
        self.after, self.batches_seen = signal_in_validation_after, 0
        self.model, self.device, self.rank, self.world_size, self.grad_accum = torch.nn.Identity(), "cpu", 0, 1, 1

    def val_batches(self):
        for i in range(4):
            if self.done == self.after and i == 1:
                os.kill(os.getpid(), signal.SIGINT)                 # deferred: the loop takes it
            yield i

    def val_loss(self, batch, ws_short, ws_long):
        self.batches_seen += 1
        return torch.tensor(3.5)

    validate = tg.Trainer.validate


@pytest.mark.parametrize("when", ["during the last step", "during the final validation"])
def test_a_signal_after_the_last_step_stops_with_the_final_state_saved(tmp_path, when):
    """No step boundary follows the last step: a signal in it, or in the final validation, stops the run there,
    instead of being announced and ignored, and the final state is saved first (named in the message)."""
    hp = tg.parse_args(["--preset=tiny", "--num_scheduled_iterations=3", "--num_extension_iterations=1",
                        "--val_loss_every=2", "--save_checkpoint", f"--log_dir={tmp_path}"])
    stops = harness.StopSignals(announce=False)
    run = harness.Run(hp, 0, 1, torch.device("cpu"), "end", harness.RunLogger(None), stops, time.perf_counter(),
                      None)
    saved = []
    checkpointer = types.SimpleNamespace(save=lambda state, periodic=False: saved.append(state["step"])
                                         or f"state_{state['step']}")
    trainer = _Trainer(hp, signal_in_step=3 if when == "during the last step" else None,
                       signal_in_final_validation=when == "during the final validation")
    stops.install()
    try:
        with pytest.raises(harness.Interrupted) as info:
            tg.timed_loop(run, trainer, checkpointer, 0, 0.0)
    finally:
        stops.uninstall()
    place = "before" if when == "during the last step" else "during"
    assert str(info.value) == f"stopped by SIGINT {place} the final validation; the final state is saved: state_4"
    assert info.value.signum == signal.SIGINT and saved == [4] and trainer.done == 4


def test_a_signal_during_a_validation_abandons_it_and_stops_as_between_steps(tmp_path):
    """A signal during a mid-run validation stops the run as a step boundary would (the same line, the state of
    the step just finished saved), and the validation's remaining batches are not run: a long validation would
    otherwise hold the stop (and the next step) past torchrun's 30 s grace."""
    hp = tg.parse_args(["--preset=tiny", "--num_scheduled_iterations=6", "--num_extension_iterations=0",
                        "--val_loss_every=2", "--save_checkpoint", f"--log_dir={tmp_path}"])
    stops = harness.StopSignals(announce=False)
    run = harness.Run(hp, 0, 1, torch.device("cpu"), "val", harness.RunLogger(None), stops, time.perf_counter(),
                      None)
    saved = []
    checkpointer = types.SimpleNamespace(save=lambda state, periodic=False: saved.append(state["step"])
                                         or f"state_{state['step']}")
    trainer = _ValidatingTrainer(hp, signal_in_validation_after=2)
    stops.install()
    try:
        with pytest.raises(harness.Interrupted) as info:
            tg.timed_loop(run, trainer, checkpointer, 0, 0.0)
    finally:
        stops.uninstall()
    total = hp.num_iterations
    assert str(info.value) == (f"stopped by SIGINT after step 2 of {total}; "
                               "the state after step 2 is saved: --resume=state_2")
    assert info.value.agreed and saved == [2] and trainer.done == 2
    assert trainer.batches_seen == 4 + 1               # step 0's whole validation, then one batch of step 2's


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_signal_in_the_last_steps_of_a_run_stops_it_with_a_state_saved(tmp_path, data):
    """The same in a real run: the signal goes in at step 3's line, so the step-3 boundary takes it (if it comes
    first) or the last step's end does; either way the run stops with a saved state and no result line."""
    args = ["--preset=tiny", "--warmup=false", "--val_loss_every=0", "--seed=0", "--save_checkpoint",
            "--num_scheduled_iterations=3", "--num_extension_iterations=1",
            f"--train_files={data[0]}", f"--val_files={data[1]}", f"--log_dir={tmp_path}/logs", "--run_id=end"]
    proc = start(args, tmp_path)
    assert wait_for_line(proc, "step:3/4 train_time") is not None
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 130 and "Traceback" not in err, err
    errors = [l for l in err.splitlines() if l.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith("error: stopped by SIGINT "), err
    step = 3 if "after step 3 of 4" in errors[0] else 4
    saved = tmp_path / "logs" / "end" / f"state_step{step:06d}.pt"
    assert errors[0].endswith(str(saved)) and torch.load(saved, weights_only=False)["step"] == step, err
    log = (tmp_path / "logs" / "end.txt").read_text()
    assert not re.search(r"^result:", log, re.M) and log.splitlines()[-1] == errors[0]   # the log embeds the code


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_console_that_went_away_still_lets_the_run_stop_and_save(tmp_path, data):
    """`./run.sh | tee out.txt` and a Ctrl-C: tee dies with it, the run's console pipe is closed, and the run must
    still reach its step boundary, save and end its log, instead of failing on the next print."""
    args = ["--preset=tiny", "--warmup=false", "--val_loss_every=0", "--seed=0", "--save_checkpoint",
            f"--train_files={data[0]}", f"--val_files={data[1]}", f"--log_dir={tmp_path}/logs", "--run_id=tee"]
    proc = start(args, tmp_path)
    assert wait_for_line(proc, "step:2/") is not None
    proc.stdout.close()                             # the reader of stdout is gone
    proc.send_signal(signal.SIGINT)
    err = proc.stderr.read()
    assert proc.wait(timeout=600) == 130, err
    errors = [l for l in err.splitlines() if l.startswith("error:")]
    assert len(errors) == 1 and "stopped by SIGINT after step" in errors[0] and "Traceback" not in err, err
    step = int(errors[0].split("after step ")[1].split()[0])
    assert torch.load(tmp_path / "logs" / "tee" / f"state_step{step:06d}.pt", weights_only=False)["step"] == step
    assert (tmp_path / "logs" / "tee.txt").read_text().splitlines()[-1] == errors[0]


def test_a_stop_outside_the_timed_loop_says_where_it_stopped():
    """Before the loop no step ran: the line says so; inside it, the loop's callers say where (after which step)."""
    stops = harness.StopSignals(announce=False)
    with pytest.raises(harness.Interrupted) as info:
        stops._on_signal(signal.SIGTERM, None)
    assert str(info.value) == "stopped by SIGTERM before the first step of this run: no step ran, so no new state is saved"
    stops.where = None
    with pytest.raises(harness.Interrupted) as info:
        stops._on_signal(signal.SIGINT, None)
    assert str(info.value) == "stopped by SIGINT" and info.value.signum == signal.SIGINT


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_ctrl_c_before_the_timed_loop_stops_at_once(tmp_path, data):
    """Outside the loop there is no step to finish: the run ends at once, with one line."""
    args = ["--preset=tiny", "--warmup=true", "--val_loss_every=0", f"--train_files={data[0]}",
            f"--val_files={data[1]}", f"--log_dir={tmp_path}/logs", "--run_id=early"]
    proc = start(args, tmp_path)
    assert wait_for_line(proc, "warmup: compiling") is not None       # the warmup runs real steps
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 130 and "Traceback" not in err, err
    assert [l for l in err.splitlines() if l.startswith("error:")] == [f"error: stopped by SIGINT {harness.IN_WARMUP}"]


# ---- the failure page -----------------------------------------------------------------------------------------------

def test_failure_page_gives_the_exit_codes_the_trainer_uses():
    """docs/failures.md (the README links it): each failure's entry names its exit code as `(exit N)`."""
    text = (ROOT / "docs" / "failures.md").read_text()
    entries = text.split("## Each failure", 1)[1]
    items = [item for item in re.split(r"\n(?=- \*\*)", entries) if item.startswith("- **")]
    found = {item.split("**")[1]: re.match(r"- \*\*[^*]+\*\* \(exit (\d+)\)", item) for item in items}
    assert [name for name, m in found.items() if m is None] == ["An interrupted download"]   # it has no exit code
    codes = {int(m[1]) for m in found.values() if m}
    assert codes == {harness.EXIT_DATA, harness.EXIT_CONFIG, harness.EXIT_DIVERGED, harness.EXIT_PEER, harness.EXIT_BUG,
                     harness.EXIT_DEVICE, 130, 143}, codes
    assert "exit 129" in entries                # SIGHUP, in the SIGTERM entry
    table = {row.split("|")[1].strip() for row in text.split("## Each failure", 1)[0].splitlines()
             if row.startswith("| ") and not row.startswith("| exit")}
    assert {str(c) for c in codes - {130, 143}} | {"0", "128+N"} == table, table


def test_a_signal_wrapped_by_the_compiler_is_still_a_signal():
    """A SIGTERM that lands inside torch.compile reaches main() wrapped in the compiler's own error (seen on 4 GPUs:
    InductorError), which a distributed run otherwise reports as a failed peer (exit 4) from every rank."""
    try:
        try:
            raise harness.Interrupted(signal.SIGTERM, "stopped by SIGTERM")
        except harness.Interrupted as inner:
            raise RuntimeError("InductorError: LoweringException") from inner
    except RuntimeError as wrapped:
        assert harness.describe_failure(wrapped, rank=0, world_size=4) == (143, "stopped by SIGTERM")



# ---- --dry_run ----------------------------------------------------------------------------------------------------

def test_dry_run_passes_on_good_data_and_writes_nothing(capsys, tmp_path, data):
    code, err, out, log = run_main(capsys, [*SHORT, "--dry_run", f"--train_files={data[0]}",
                                            f"--val_files={data[1]}"], tmp_path)
    assert code == 0 and err == [] and log is None          # no log, nothing trained
    lines = out.splitlines()
    assert lines[0].startswith("dry run:") and lines[-1].startswith("dry run passed")
    checks = [x.split()[1].rstrip(":") for x in lines[1:-1]]
    assert checks == ["options", "environment", "output", "memory", "data"], lines   # memory: the host's, on a CPU
    assert all(x.startswith("  ok  ") for x in lines[1:-1])
    assert f"the log would be {tmp_path}/logs/run.txt" in out
    assert list((tmp_path / "logs").iterdir()) == []


@pytest.mark.parametrize("args, want_code, needle, passed", [
    (["--val_tokens=1048576"], harness.EXIT_DATA, "validation reads 1,048,576 tokens", ["options", "environment",
                                                                                  "output"]),
    (["--num_heads=5"], harness.EXIT_CONFIG, "--num_heads", []),
])
def test_dry_run_stops_at_the_first_failing_check(capsys, tmp_path, data, args, want_code, needle, passed):
    code, err, out, log = run_main(capsys, [*SHORT, "--dry_run", f"--train_files={data[0]}",
                                            f"--val_files={data[1]}", *args], tmp_path)
    assert_one_error(code, err, want_code, needle)
    assert [x.split()[1].rstrip(":") for x in out.splitlines() if x.startswith("  ok  ")] == passed
    assert "dry run passed" not in out and log is None
