"""Checkpoints and --resume: a resumed run is bit for bit the run that was stopped; what cannot continue it is
refused."""
import dataclasses
import re
import shlex
from pathlib import Path

import pytest
import torch

import train_gpt as tg
import triton_kernels as tk
import harness  # noqa: E402
from _shards import make_dataset, run_gloo, run_trainer

# Eight steps with a new batch size and long window at steps 2, 4 and 6 (YaRN each time), Adam on odd steps (its
# gradients add up over the even ones), and the untie after step 5. Checkpoints after 3 and 6 steps: resuming from 3
# crosses a window change, the untie and the extension; resuming from 6 starts untied, right at the extension.
SCHEDULE = ["--preset=tiny", "--fp8_mlp=true", "--num_scheduled_iterations=6", "--num_extension_iterations=2",
            "--val_loss_every=2", "--seed=0", "--warmup=false", "--checkpoint_every=3", "--save_checkpoint=true"]
COMPARED = ("model", "optimizer", "grads", "loader", "rng", "step")


def val_lines(log: Path) -> list[tuple[str, str]]:
    """(step, val_loss) of every validation line; the train_time beside them differs from run to run."""
    return [tuple(line.split()[:2]) for line in log.read_text().splitlines()
            if line.startswith("step:") and " val_loss:" in line]


def state(log_dir: Path, run_id: str, step: int, rank: int | None = None) -> dict:
    suffix = "" if rank is None else f"_rank{rank}"
    return torch.load(log_dir / run_id / f"state_step{step:06d}{suffix}.pt", weights_only=True)


def test_schedule_crosses_what_the_resume_must_restore():
    hp = tg.parse_args(SCHEDULE)
    ws = [tg.schedule_at(s, hp).ws_long for s in range(hp.num_iterations)]
    batch = [tg.schedule_at(s, hp).global_batch for s in range(hp.num_iterations)]
    assert hp.num_iterations == 8 and hp.untie_step == 5
    assert ws == [3, 3, 7, 7, 11, 11, 13, 13] and batch == [512, 512, 768, 768, 1024, 1024, 1024, 1024]
    assert [tg.schedule_at(s, hp).do_adam for s in range(3)] == [False, True, False]   # grads pending after step 3


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("world_size", [1, 2])
def test_resumed_run_is_bitwise_the_straight_run(tmp_path, world_size):
    train, val = make_dataset(tmp_path / "d", train_tokens=400_000, val_tokens=20_000)
    logs = tmp_path / "logs"
    common = [*SCHEDULE, f"--batch_slices={2 * world_size}", f"--train_files={train}", f"--val_files={val}",
              f"--log_dir={logs}"]

    def run(args):
        if world_size == 1:
            p = run_trainer(args, tmp_path)
            assert p.returncode == 0, p.stderr[-3000:]
        else:
            for p in run_gloo(args, world_size, tmp_path):
                assert p.returncode == 0, p.stderr[-3000:]

    run([*common, "--run_id=straight"])
    ranks = [None] if world_size == 1 else list(range(world_size))
    saved = sorted(f.name for f in (logs / "straight").iterdir())
    assert saved == sorted(f"state_step{s:06d}{'' if r is None else f'_rank{r}'}.pt" for s in (3, 6, 8) for r in ranks)
    starts = (3, 6) if world_size == 1 else (3,)
    for start in starts:
        name = f"state_step{start:06d}{'' if world_size == 1 else '_rank1'}.pt"     # any rank's file names the state
        # from 3 on one process the command line repeats the run's options; from 6, and on two processes (each rank
        # reads its own file), --resume alone takes them from the state
        alone = start == 6 or world_size == 2
        run_id = f"straight-from{start}" if alone else f"from{start}"
        resume = f"--resume={logs / 'straight' / name}"
        run([resume] if alone else [*common, resume, f"--run_id={run_id}"])
        for r in ranks:
            a, b = state(logs, "straight", 8, r), state(logs, run_id, 8, r)
            for key in COMPARED:
                assert harness.states_equal(a[key], b[key]), (start, r, key)
        straight = val_lines(logs / "straight.txt")
        assert val_lines(logs / f"{run_id}.txt") == [v for v in straight if int(v[0][5:].split("/")[0]) >= start]
        resumed_log = (logs / f"{run_id}.txt").read_text().splitlines()
        assert any(line.startswith("resumed from") and f"after step {start} of 8" in line for line in resumed_log)
        assert not any(line.startswith("warning:") for line in resumed_log)
        reused = [line for line in resumed_log if line.startswith("resume: the options the command line leaves out")]
        assert len(reused) == (1 if alone else 0) and all("--preset=tiny " in line for line in reused), reused


def test_run_folder_lists_its_states_newest_first_for_the_process_count(tmp_path):
    """find_checkpoint lists by name; load_checkpoint then checks each set (tests/test_durable_states.py)."""
    folder = tmp_path / "run"
    folder.mkdir()
    for name in ("state_step000003_rank0.pt", "state_step000003_rank1.pt", "state_step000006_rank0.pt",
                 "state_step000002.pt", "notes.txt"):
        (folder / name).write_bytes(b"")
    assert harness.find_checkpoint(str(folder), 2) == (folder, [6, 3])    # 6 misses rank 1: checked as a set later
    assert harness.find_checkpoint(str(folder), 1) == (folder, [2])
    assert harness.find_checkpoint(str(folder / "state_step000006_rank0.pt"), 2) == (folder, [6])
    assert harness.find_checkpoint(str(folder), 4) == (folder, [6, 3])    # their seals say 2 processes: refused later
    single = tmp_path / "single"
    single.mkdir()
    (single / "state_step000002.pt").write_bytes(b"")
    with pytest.raises(tg.ConfigError, match=r"states of 1 process\(es\) \(steps \[2\]\), none written by 2 process"):
        harness.find_checkpoint(str(single), 2)
    four = tmp_path / "four"             # a two-node run's states: on fewer processes, refused naming the count
    four.mkdir()
    for rank in range(4):
        (four / f"state_step000004_rank{rank}.pt").write_bytes(b"")
    with pytest.raises(tg.ConfigError, match=r"holds states of 4 process\(es\) \(steps \[4\]\), none written by 2 "
                                             r"process\(es\): resume with 4 processes \(NPROC=4 \./run\.sh, or NNODES x NPROC = 4"):
        harness.find_checkpoint(str(four), 2)
    assert harness.find_checkpoint(str(four), 4) == (four, [4])
    with pytest.raises(tg.ConfigError, match="neither a folder nor a state_step"):
        harness.find_checkpoint(str(folder / "notes.txt"), 1)


def test_unreadable_or_foreign_state_files_are_refused(tmp_path):
    (tmp_path / "state_step000004.pt").write_bytes(b"PK\x03\x04 cut short")
    with pytest.raises(tg.ConfigError, match="state_step000004.pt: truncated .* Resume from an earlier state"):
        harness.load_checkpoint(str(tmp_path / "state_step000004.pt"), 0, 1)
    torch.save({"model": {}}, tmp_path / "state_step000005.pt")
    with pytest.raises(tg.ConfigError, match="not a training state written by this trainer"):
        harness.load_checkpoint(str(tmp_path / "state_step000005.pt"), 0, 1)


def test_periodic_checkpoints_keep_the_newest(tmp_path):
    hp = tg.parse_args(["--preset=tiny", f"--log_dir={tmp_path}", "--checkpoint_keep=2"])
    lines = []
    ck = harness.Checkpointer(hp, "run", 0, 1, {"processes": 1}, lines.append)
    for step in (2, 4, 6):
        ck.save({"step": step, "model": {"w": torch.full((2,), float(step))}}, periodic=True)
    ck.save({"step": 7, "model": {}})                                  # a stop's or the end's state: kept
    ck.save({"step": 8, "model": {}}, periodic=True)
    assert sorted(f.name for f in (tmp_path / "run").iterdir()) == [
        "state_step000006.pt", "state_step000007.pt", "state_step000008.pt"]
    saved = torch.load(tmp_path / "run" / "state_step000006.pt", weights_only=True)
    assert saved["format"] == harness.CHECKPOINT_FORMAT and torch.equal(saved["model"]["w"], torch.full((2,), 6.0))
    assert lines[-1].endswith("state_step000008.pt")


def test_resume_names_every_math_difference_and_lets_run_control_differ():
    hp = tg.parse_args(SCHEDULE)
    facts = {"processes": 1, "device": "cpu", "attention backend": "sdpa", "training shards": ["a.bin", "b.bin"]}
    saved = {"hyperparameters": tg.dataclasses.asdict(hp), "facts": dict(facts)}
    free = tg.parse_args([*SCHEDULE, "--val_loss_every=5", "--log_dir=elsewhere", "--checkpoint_every=0",
                          "--train_files=/other/place/*.bin", "--nonfinite_check_every=0"])
    assert harness.resume_differences(saved, free, facts) == []
    other = tg.parse_args([*SCHEDULE, "--muon_lr=0.03", "--num_extension_iterations=3"])
    now = dict(facts, processes=2, **{"training shards": ["a.bin", "c.bin"]})
    diffs = harness.resume_differences(saved, other, now)
    assert any(d.startswith("--num_extension_iterations=2 (now 3)") for d in diffs)
    assert any(d.startswith("--muon_lr=0.023 (now 0.03)") for d in diffs)
    assert "processes 1 (now 2)" in diffs
    assert "training shards: number 2 is b.bin (now c.bin)" in diffs
    assert len(diffs) == 4


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_refused_resumes_are_one_error_line_and_leave_nothing_behind(tmp_path):
    """Other math is refused by name (before the data checks, which other options would fail), so is a shorter
    schedule than the state's, and so is a new run that would replace the states of an earlier one
    with its --run_id. None of them leaves a log or changes a file, so the corrected command then continues the run
    under the id the resume gives it; where an earlier try at that resume left its log, under the next free one."""
    train, val = make_dataset(tmp_path / "d", train_tokens=400_000, val_tokens=20_000)
    logs = tmp_path / "logs"
    common = [*SCHEDULE, "--num_scheduled_iterations=3", "--num_extension_iterations=1", f"--train_files={train}",
              f"--val_files={val}", f"--log_dir={logs}", "--checkpoint_every=2"]
    p = run_trainer([*common, "--run_id=a"], tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    (logs / "a.txt").rename(tmp_path / "a.txt")         # as the refusal of a reused --run_id suggests
    before = {f: f.read_bytes() for f in logs.rglob("*") if f.is_file()}
    middle, final = logs / "a" / "state_step000002.pt", logs / "a" / "state_step000004.pt"
    default_schedule = [a for a in common if not a.startswith(("--num_scheduled", "--num_extension"))]
    for args, words in (([*common, "--adam_lr=0.01", f"--resume={middle}"],
                         f"--adam_lr=0.008 (now 0.01). A resume takes the state's options where the command line "
                         f"gives none; continue it with its 1 process(es): python3 train_gpt.py --resume={middle}"),
                        ([*default_schedule, "--num_scheduled_iterations=3000", f"--resume={middle}"],
                         "other math: --num_scheduled_iterations=3 (now 3000)"),    # more than the data holds
                        ([*common, "--num_extension_iterations=0", f"--resume={final}"],
                         "after step 4 of a run of 4 steps, and these options give 3: continue it with its own "
                         f"options: python3 train_gpt.py --resume={final}"),
                        ([*common, "--run_id=a", "--seed=1"], f"{logs / 'a'} holds the states of an earlier run")):
        p = run_trainer(args, tmp_path)
        assert p.returncode == 2 and "Traceback" not in p.stderr
        errors = [line for line in p.stderr.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and words in errors[0], p.stderr
        assert {f: f.read_bytes() for f in logs.rglob("*") if f.is_file()} == before    # no log, nothing changed
    (logs / "a-from2.txt").write_text("an earlier try at this resume, stopped before it trained\n")
    p = run_trainer([*common, f"--resume={middle}", "--dry_run"], tmp_path)
    assert p.returncode == 0 and f"the log would be {logs}/a-from2.2.txt" in p.stdout, p.stdout + p.stderr
    p = run_trainer([*common, f"--resume={middle}"], tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    assert re.search(r"^result: ", (logs / "a-from2.2.txt").read_text(), re.M)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_state_saved_before_the_final_validation_resumes_into_the_result_line(tmp_path):
    """A stop before or during the final validation saves the state after the last step: the file a run with
    --save_checkpoint writes just before it validates. Resuming it trains nothing, runs the final validation and
    writes the result line, with the loss and the train time of the run it continues (the clock never starts)."""
    train, val = make_dataset(tmp_path / "d", train_tokens=400_000, val_tokens=20_000)
    logs = tmp_path / "logs"
    common = ["--preset=tiny", "--num_scheduled_iterations=3", "--num_extension_iterations=1", "--val_loss_every=0",
              "--seed=0", "--warmup=false", "--save_checkpoint", f"--train_files={train}", f"--val_files={val}",
              f"--log_dir={logs}"]
    p = run_trainer([*common, "--run_id=a"], tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    p = run_trainer([*common, f"--resume={logs / 'a' / 'state_step000004.pt'}"], tmp_path)
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr[-3000:]
    first, resumed = ((logs / name).read_text().splitlines() for name in ("a.txt", "a-from4.txt"))
    assert any(line.startswith("resumed from ") and "after step 4 of 4" in line for line in resumed)
    assert not [line for line in resumed if line.startswith("step:") and "val_loss" not in line]   # no step trained
    assert [line for line in resumed if "val_loss:" in line and line.startswith("step:4/4")] == \
        [line for line in first if "val_loss:" in line and line.startswith("step:4/4")]
    assert resumed[-1].startswith("result: ") and resumed[-1].split(" log:")[0] == first[-1].split(" log:")[0]


# ---- --resume alone: the options a command line leaves out are the state's -------------------------------------------

def test_a_command_line_gives_the_options_it_names_and_its_presets_math():
    """A resume takes the state's value of every option the command line does not give. --preset=NAME gives the math
    fields the preset sets (they are compared with the state's); its run-control values are a new run's defaults, which
    a resume takes from the state instead."""
    given = harness.given_options(["--preset=tiny", "--log-dir=x", "--save_checkpoint", "--resume=r"], tg.PRESETS)
    assert {"preset", "log_dir", "save_checkpoint", "resume", "model_dim", "num_scheduled_iterations"} <= given
    assert not given & {"val_loss_every", "attn_backend", "warmup"}
    assert harness.given_options(["--muon_lr=0.03", "--resume=r"], tg.PRESETS) == {"muon_lr", "resume"}


WHOLE = {key: 0 for key in harness.STATE_KEYS - {"run_id", "hyperparameters", "facts", "code"}}


def test_each_rank_takes_the_options_of_its_own_file_and_a_rewritten_batch_slices_resumes(tmp_path):
    """Two processes of --batch_slices=1 run (and save) batch_slices=2 (slices_for). --resume=<folder> alone takes the
    state's options on each rank from its own file, the newest that reads, before any process group exists; the
    per-command options (--resume, --run_id) stay the command line's; the checks then find no difference."""
    ran = tg.slices_for(tg.parse_args(["--preset=tiny", "--batch_slices=1", "--num_scheduled_iterations=6",
                                       "--val_loss_every=3", f"--log_dir={tmp_path}", "--save_checkpoint",
                                       "--run_id=run"]), 2)
    assert ran.batch_slices == 2
    facts = {"processes": 2, "device": "cpu", "attention backend": "sdpa", "training shards": ["a.bin"]}
    for rank in (0, 1):
        saver = harness.Checkpointer(ran, "run", rank, 2, facts, lambda line: None, "code")
        for step in (4, 6):
            saver.save({**WHOLE, "step": step, "model": {"w": torch.full((3,), float(rank))}})
    newest = tmp_path / "run" / "state_step000006_rank0.pt"
    newest.write_bytes(newest.read_bytes()[:1000])                       # rank 0's newest is cut short
    argv = [f"--resume={tmp_path / 'run'}"]
    for rank, step in ((0, 4), (1, 6)):
        saved = harness.state_options(str(tmp_path / "run"), rank, 2)
        assert saved["path"] == str(tmp_path / "run" / f"state_step{step:06d}_rank{rank}.pt")
        hp, line = harness.reuse_state_options(tg.parse_args(argv), harness.given_options(argv, tg.PRESETS), saved,
                                               tg.PRESETS)
        hp = tg.slices_for(hp, 2)
        tg.validate_hyperparameters(hp, 2)
        assert harness.resume_differences(saved, hp, facts) == []
        assert (hp.batch_slices, hp.val_loss_every, hp.save_checkpoint) == (2, 3, True)
        assert (hp.resume, hp.run_id) == (str(tmp_path / "run"), "")        # a new run id: <id>-from<step>
        assert line.startswith(f"resume: the options the command line leaves out are the state's ({saved['path']}): "
                               "--preset=tiny ")
        assert " --val_loss_every=3 " in line and "--resume" not in line and "--run_id" not in line
    assert harness.state_options(str(tmp_path / "nothing"), 0, 1) is None      # load_resume then says why
    # a state of another optimizer table: no command line sets the table, so the code's stays and is compared
    table = {**saved["hyperparameters"]["param_table"], "new": {"optim": "adam"}}
    edited = {**saved, "hyperparameters": {**saved["hyperparameters"], "param_table": table}}
    hp, _ = harness.reuse_state_options(tg.parse_args(argv), {"resume"}, edited, tg.PRESETS)
    assert hp.param_table == tg.Hyperparameters().param_table
    diffs = harness.resume_differences(edited, tg.slices_for(hp, 2), facts)
    assert [d.split("=")[0] for d in diffs] == ["--param_table"], diffs


def test_the_command_a_refusal_gives_has_the_launcher_and_the_changed_run_control_only():
    """The command that continues a state: its process count's launcher, --resume as given, the run-control options
    that are not the state's (a resume may change them) and the per-command ones given; no math option."""
    saved = {"hyperparameters": dataclasses.asdict(tg.parse_args(SCHEDULE)), "facts": {"processes": 1}}
    hp = tg.parse_args([*SCHEDULE, "--resume=logs/r", "--log_dir=new place", "--muon_lr=0.03"])
    assert harness.resume_command(saved, hp) == "python3 train_gpt.py --resume=logs/r '--log_dir=new place'"
    hp = dataclasses.replace(hp, run_id="again", dry_run=True)
    assert harness.resume_command(dict(saved, facts={"processes": 2}), hp, "my_idea.py", ["log_dir"]) == \
        "TRAIN=my_idea.py NPROC=2 ./run.sh --resume=logs/r --run_id=again --dry_run"
    assert harness.resume_command(dict(saved, facts={"processes": 16}), hp) == (
        "NNODES=2 MASTER_ADDR=<the first node> ./run.sh --resume=logs/r --run_id=again '--log_dir=new place' "
        "--dry_run (on every node)")


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_resume_alone_continues_refuses_other_math_with_the_command_and_takes_new_run_control(tmp_path):
    """--resume=PATH alone: the options it leaves out are the state's. An explicit math option that differs is refused
    in one line ending with the command that continues the state, which keeps the run-control option given (a resume
    may change it); the dry run names the options it takes; pasted, the command finishes with the uninterrupted run's
    final state and loss, validating at the new cadence."""
    train, val = make_dataset(tmp_path / "d", train_tokens=400_000, val_tokens=20_000)
    logs = tmp_path / "logs"
    p = run_trainer([*SCHEDULE, "--num_scheduled_iterations=3", "--num_extension_iterations=1", "--checkpoint_every=2",
                     f"--train_files={train}", f"--val_files={val}", f"--log_dir={logs}", "--run_id=a"], tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    middle = logs / "a" / "state_step000002.pt"
    before = {f: f.read_bytes() for f in logs.rglob("*") if f.is_file()}

    p = run_trainer([f"--resume={middle}", "--adam_lr=0.01", "--val_loss_every=1"], tmp_path)
    errors = [line for line in p.stderr.splitlines() if line.startswith("error:")]
    assert p.returncode == 2 and "Traceback" not in p.stderr and len(errors) == 1, p.stderr
    command = f"python3 train_gpt.py --resume={middle} --val_loss_every=1"
    assert errors[0] == (f"error: --resume: {middle} was written by a run with other math: --adam_lr=0.008 (now "
                         "0.01). A resume takes the state's options where the command line gives none; continue it "
                         f"with its 1 process(es): {command}"), errors[0]
    assert {f: f.read_bytes() for f in logs.rglob("*") if f.is_file()} == before       # no log, nothing changed

    p = run_trainer([f"--resume={middle}", "--dry_run"], tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr
    taken = f"resume: the options the command line leaves out are the state's ({middle}): --preset=tiny "
    assert f"  ok  {taken}" in p.stdout and f"the log would be {logs}/a-from2.txt" in p.stdout, p.stdout
    line = next(line for line in p.stdout.splitlines() if taken in line)
    for option in ("--val_loss_every=2", "--seed=0", "--checkpoint_every=2", "--save_checkpoint",    # the preset's
                   "--num_scheduled_iterations=3", "--num_extension_iterations=1", f"--log_dir={logs}",  # values are
                   f"'--train_files={train}'"):                                                          # not listed
        assert f" {option}" in line, line
    assert "--warmup" not in line and "--model_dim" not in line, line

    p = run_trainer(shlex.split(command)[2:], tmp_path)                              # the command, pasted
    assert p.returncode == 0, p.stderr[-3000:]
    straight, resumed = val_lines(logs / "a.txt"), val_lines(logs / "a-from2.txt")
    assert [step for step, _ in straight] == ["step:0/4", "step:2/4", "step:4/4"]
    assert [step for step, _ in resumed] == ["step:2/4", "step:3/4", "step:4/4"]    # every step: the new cadence
    assert resumed[0] == straight[1] and resumed[-1] == straight[-1]
    assert taken in (logs / "a-from2.txt").read_text()
    a, b = state(logs, "a", 4), state(logs, "a-from2", 4)                            # --save_checkpoint: the state's
    for key in COMPARED:
        assert harness.states_equal(a[key], b[key]), key


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_resume_after_the_first_delayed_fp8_down_refresh_is_bitwise_the_straight_run(tmp_path):
    """The FP8 down projection bootstraps its weight scales after the first tk.FP8_DOWN_BOOTSTRAP_STEPS optimizer
    steps, then quantises with the scale the previous refresh set aside. The first state whose FP8 weights used a
    set-aside scale is resumed: the run must restore the scales in use, the set-aside ones and the activation scales
    of every batch slice, not bootstrap again."""
    start = tk.FP8_DOWN_BOOTSTRAP_STEPS + 1
    train, val = make_dataset(tmp_path / "d", train_tokens=400_000, val_tokens=20_000)
    logs = tmp_path / "logs"
    common = ["--preset=tiny", "--fp8_mlp=true", f"--num_scheduled_iterations={start}",
              "--num_extension_iterations=2", f"--val_loss_every={start}", "--seed=0", "--warmup=false",
              f"--checkpoint_every={start}", "--save_checkpoint=true", "--batch_slices=2",
              f"--train_files={train}", f"--val_files={val}", f"--log_dir={logs}"]
    p = run_trainer([*common, "--run_id=straight"], tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    end = start + 2
    saved = state(logs, "straight", start)["model"]
    # the scale set aside differs from the one in use, and each slice's activation scales have moved from 1
    assert not torch.equal(saved["fp8_down.next_weight_scales"], saved["fp8_down.weight_scales"])
    assert (saved["fp8_down.act_scales"] != 1).all()
    assert not torch.equal(saved["fp8_down.act_scales"][0], saved["fp8_down.act_scales"][1])
    p = run_trainer([*common, f"--resume={logs / 'straight' / f'state_step{start:06d}.pt'}",
                     "--run_id=resumed"], tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    a, b = state(logs, "straight", end), state(logs, "resumed", end)
    for key in COMPARED:
        assert harness.states_equal(a[key], b[key]), key
    assert val_lines(logs / "resumed.txt") == [v for v in val_lines(logs / "straight.txt")
                                                 if int(v[0][5:].split("/")[0]) >= start]
