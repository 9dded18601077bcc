"""States that survive a power cut (issue 56, families 1 and 3): every write is fsynced (file, then folder after the
rename), a killed writer's temporary is removed once its process is gone, each state carries a seal (size and sha256
in its zip comment) checked before anything is unpickled, --resume=<folder> walks back to the newest state whole on
every rank with one line per state it skipped, and a damaged state named directly is one error line naming it."""
import os
import re
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import harness
import train_gpt as tg
from _shards import make_dataset, run_gloo, run_trainer

WHOLE = {key: 0 for key in harness.STATE_KEYS}     # a state load_checkpoint accepts; the trainer never sees it


def save_states(log_dir: Path, run_id: str, steps, rank: int = 0, world_size: int = 1) -> list[Path]:
    hp = tg.parse_args([f"--log_dir={log_dir}"])
    saver = harness.Checkpointer(hp, run_id, rank, world_size, {}, lambda line: None, "code")
    return [saver.save({**WHOLE, "step": step, "model": {"w": torch.arange(4000.0) + step}}) for step in steps]


def dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


# ---- 1. the power-cut simulation: a cut-short newest state beside an older whole one ---------------------------------

@pytest.mark.parametrize("tenths", range(10))
def test_a_state_cut_at_every_tenth_of_its_length_is_skipped_for_the_older_one(tmp_path, tenths):
    older, newest = save_states(tmp_path, "run", (2, 4))
    whole = newest.read_bytes()
    newest.write_bytes(whole[:len(whole) * tenths // 10])               # 0 %: the 0-byte file a rename leaves
    state = harness.load_checkpoint(str(tmp_path / "run"), 0, 1)
    assert state["step"] == 2 and state["path"] == str(older)
    assert torch.equal(state["model"]["w"], torch.arange(4000.0) + 2)
    [note] = state["notes"]
    assert note.startswith("note: skipped state_step000004.pt: ") and note.endswith(
        "; resuming from state_step000002.pt"), note
    assert ("empty (0 bytes" if tenths == 0 else f"truncated ({len(whole) * tenths // 10:,} bytes") in note


@pytest.mark.parametrize("damage", ["flipped byte", "flipped seal", "cut seal", "renamed"])
def test_a_whole_length_state_with_a_bad_seal_is_skipped(tmp_path, damage):
    """Damage a length check alone would miss: a flipped byte in the archive or in the seal's run id (the digest),
    the seal's last byte lost, a state renamed to a newer step."""
    older, newest = save_states(tmp_path, "run", (2, 4))
    data = bytearray(newest.read_bytes())
    if damage == "flipped byte":
        data[len(data) // 2] ^= 0x40
        newest.write_bytes(data)
    elif damage == "flipped seal":
        newest.write_bytes(bytes(data).replace(b'"run_id": "run"', b'"run_id": "rum"'))
    elif damage == "cut seal":
        newest.write_bytes(data[:-1])
    else:
        newest.unlink()
        (tmp_path / "run" / "state_step000006.pt").write_bytes(older.read_bytes())
    state = harness.load_checkpoint(str(tmp_path / "run"), 0, 1)
    [note] = state["notes"]
    assert state["step"] == 2 and note.startswith("note: skipped state_step00000")
    assert {"flipped byte": "sha256 does not match", "flipped seal": "sha256 does not match", "cut seal": "truncated",
            "renamed": "not rank 0 of 1 after step 6 (a renamed file)"}[damage] in note, note


def test_a_damaged_state_named_directly_is_one_error_naming_it_and_the_fix(tmp_path):
    _, newest = save_states(tmp_path, "run", (2, 4))
    newest.write_bytes(newest.read_bytes()[:1000])
    with pytest.raises(harness.ConfigError) as info:
        harness.load_checkpoint(str(newest), 0, 1)
    message = str(info.value)
    assert message.startswith(f"--resume: {newest}: truncated (1,000 bytes") and "\n" not in message
    assert f"--resume={tmp_path / 'run'}" in message and "bug" not in message
    assert harness.describe_failure(info.value, 0, 1)[0] == harness.EXIT_CONFIG


def test_a_folder_with_no_whole_state_names_each_and_why(tmp_path):
    a, b = save_states(tmp_path, "run", (2, 4))
    a.write_bytes(b"")
    b.write_bytes(b.read_bytes()[:-100])
    with pytest.raises(harness.ConfigError, match=r"no state in the folder is whole on all 1 process\(es\): "
                       r"state_step000004.pt: truncated .*; state_step000002.pt: empty"):
        harness.load_checkpoint(str(tmp_path / "run"), 0, 1)


def test_states_written_before_the_seal_still_load_and_are_checked_by_loading(tmp_path):
    folder = tmp_path / "run"
    folder.mkdir()
    for step in (2, 4):
        torch.save({**WHOLE, "format": harness.CHECKPOINT_FORMAT, "run_id": "old", "step": step},
                   folder / f"state_step{step:06d}.pt")
    assert harness.load_checkpoint(str(folder), 0, 1)["step"] == 4
    assert harness.inspect_state(folder / "state_step000004.pt", 4, 0, 1) == ({}, None)
    cut = folder / "state_step000004.pt"
    cut.write_bytes(cut.read_bytes()[:-30])                      # into the end record: no longer a zip
    state = harness.load_checkpoint(str(folder), 0, 1)
    assert state["step"] == 2 and "state_step000004.pt: truncated" in state["notes"][0]


def test_the_seal_keeps_a_state_a_zip_that_torch_load_reads(tmp_path):
    [path] = save_states(tmp_path, "run", (3,))
    record, problem = harness.inspect_state(path, 3, 0, 1)
    assert problem is None and record == {"run_id": "run", "step": 3, "rank": 0, "world_size": 1}
    assert torch.load(path, weights_only=True)["step"] == 3
    import zipfile
    with zipfile.ZipFile(path) as z:
        assert z.comment.startswith(harness.STATE_SEAL) and z.testzip() is None


# ---- 1. durable writes and stale temporaries -------------------------------------------------------------------------

def test_a_write_fsyncs_the_file_then_the_folder_after_the_rename(tmp_path, monkeypatch):
    synced, real_fsync, real_replace = [], os.fsync, os.replace

    def fsync(fd):
        st = os.fstat(fd)
        synced.append(("folder" if stat.S_ISDIR(st.st_mode) else "file", (st.st_dev, st.st_ino)))
        real_fsync(fd)

    def replace(a, b):
        synced.append(("rename", None))
        real_replace(a, b)
    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    [path] = save_states(tmp_path, "run", (2,))
    kinds = [kind for kind, _ in synced]
    assert kinds == ["file", "rename", "folder"], kinds
    st, folder = path.stat(), path.parent.stat()
    assert synced[0][1] == (st.st_dev, st.st_ino) and synced[2][1] == (folder.st_dev, folder.st_ino)


def test_stale_temporaries_of_dead_writers_are_removed_and_live_ones_kept(tmp_path):
    hp = tg.parse_args([f"--log_dir={tmp_path}", "--save_checkpoint=true"])
    folder = tmp_path / "run"
    folder.mkdir()
    dead = folder / f"state_step000004.pt.tmp{dead_pid()}"
    live = folder / f"state_step000006.pt.tmp{os.getpid()}"
    other = folder / "notes.tmp.txt"
    for f in (dead, live, other):
        f.write_bytes(b"partial")
    harness.prepare_output(hp, "run", 0)                          # a run that saves into this folder
    assert not dead.exists() and live.exists() and other.exists()
    dead = folder / f"state_step000002.pt.tmp{dead_pid()}"       # the folder a --resume reads
    dead.write_bytes(b"partial")
    save_states(tmp_path, "run", (2,))
    state = harness.load_checkpoint(str(folder), 0, 1)
    assert not dead.exists() and live.exists()
    assert state["notes"] == [f"note: removed {dead}, the temporary file of a write that was cut short"]


# ---- 3. multi-process state sets, checked as sets --------------------------------------------------------------------

def test_a_set_names_its_first_missing_damaged_or_foreign_file():
    whole = [("s_rank0.pt", None, "a"), ("s_rank1.pt", None, "a"), ("s_rank2.pt", None, None)]
    assert harness.set_problem(whole) is None                       # None: a state written before the seal
    assert harness.set_problem([whole[0], ("s_rank1.pt", "missing", None), whole[2]]) == ("s_rank1.pt", "missing")
    assert harness.set_problem([whole[0], whole[1], ("s_rank2.pt", None, "b")]) == (
        "s_rank2.pt", "foreign (from run b; s_rank0.pt is from run a)")


def test_a_rank_file_sealed_for_another_rank_or_process_count_is_refused(tmp_path):
    [path] = save_states(tmp_path, "run", (2,), rank=1, world_size=2)
    assert harness.inspect_state(path, 2, 1, 2) == ({"run_id": "run", "step": 2, "rank": 1, "world_size": 2}, None)
    assert "holds rank 1 of 2 after step 2, not rank 0 of 2" in harness.inspect_state(path, 2, 0, 2)[1]
    assert "not rank 1 of 4" in harness.inspect_state(path, 2, 1, 4)[1]
    assert harness.inspect_state(path.with_name("state_step000002_rank0.pt"), 2, 0, 2) == (
        {}, "missing (the step-2 state has state_step000002_rank1.pt)")


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_two_process_state_set_is_checked_on_every_rank_before_loading(tmp_path):
    """A 2-process run saves sets at steps 2, 4 and 5 (the last). Naming a set with rank 1's file removed, cut short
    or taken from another run is refused in one line naming that file; --resume=<folder> with the newest set broken
    continues on both ranks from the newest whole one, saying which it skipped."""
    train, val = make_dataset(tmp_path / "d", train_tokens=200_000, val_tokens=20_000)
    logs = tmp_path / "logs"
    # float32 pinned: --dtype=auto would add a note about this CPU's bf16 to the notes compared below
    common = ["--preset=tiny", "--dtype=float32", "--num_scheduled_iterations=4", "--num_extension_iterations=1",
              "--warmup=false", "--seed=0", "--checkpoint_every=2", "--save_checkpoint=true", "--batch_slices=2",
              f"--train_files={train}", f"--val_files={val}", f"--log_dir={logs}"]
    for p in run_gloo([*common, "--run_id=a"], 2, tmp_path):
        assert p.returncode == 0, p.stderr[-3000:]
    folder = logs / "a"
    assert sorted(f.name for f in folder.iterdir()) == [f"state_step{s:06d}_rank{r}.pt" for s in (2, 4, 5)
                                                         for r in (0, 1)]
    rank1 = folder / "state_step000004_rank1.pt"
    kept = rank1.read_bytes()
    foreign = torch.load(rank1, weights_only=True)
    foreign["run_id"] = "b"                                          # the same step and rank of another run
    hp_b = tg.parse_args([f"--log_dir={tmp_path / 'other'}"])
    taken = harness.Checkpointer(hp_b, "b", 1, 2, foreign["facts"], lambda line: None, foreign["code"]).save(foreign)

    def refused(damage, words):
        if damage == "removed":
            rank1.unlink()
        elif damage == "truncated":
            rank1.write_bytes(kept[:len(kept) // 3])
        else:
            rank1.write_bytes(taken.read_bytes())
        ps = run_gloo([*common, f"--resume={folder / 'state_step000004_rank0.pt'}"], 2, tmp_path, timeout=300)
        rank1.write_bytes(kept)
        assert [p.returncode for p in ps] == [2, 2], ps[0].stderr[-3000:] + ps[1].stderr[-3000:]
        errors = [line for p in ps for line in p.stderr.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and errors[0].startswith(f"error: rank 0: --resume: {rank1}: {words}"), errors
        assert not any("Traceback" in p.stderr or "bug" in p.stderr for p in ps)

    refused("removed", "missing (the step-4 state has state_step000004_rank0.pt)")
    refused("truncated", f"truncated ({len(kept) // 3:,} bytes")
    refused("foreign", "foreign (from run b; state_step000004_rank0.pt is from run a)")
    assert sorted(f.name for f in logs.iterdir()) == ["a", "a.txt"]     # refused before the log: nothing left

    (folder / "state_step000005_rank1.pt").write_bytes(b"")          # the last set: rank 1's cut at 0 bytes
    ps = run_gloo([*common, f"--resume={folder}"], 2, tmp_path)
    for p in ps:
        assert p.returncode == 0, p.stderr[-3000:]
    notes = [line for line in ps[0].stdout.splitlines() if line.startswith("note:")]
    assert notes == ["note: skipped state_step000005_rank1.pt: empty (0 bytes, a write cut short); resuming from "
                     "state_step000004_rank*.pt"], ps[0].stdout[-3000:]
    log = (logs / "a-from4.txt").read_text()
    assert notes[0] in log and "resumed from" in log and re.search(r"^result: ", log, re.M)
    for r in (0, 1):                                                 # both ranks continued the same step
        assert torch.load(logs / "a-from4" / f"state_step000005_rank{r}.pt", weights_only=True)["step"] == 5


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_power_cut_run_resumes_its_folder_from_the_older_state_end_to_end(tmp_path):
    """One process, end to end: the newest state cut at 60 %, --resume=<folder> continues from the one before,
    with one line on the console and in the log; naming the cut state is one error line (exit 2)."""
    train, val = make_dataset(tmp_path / "d", train_tokens=120_000, val_tokens=20_000)
    logs = tmp_path / "logs"
    common = ["--preset=tiny", "--dtype=float32", "--num_scheduled_iterations=4", "--num_extension_iterations=1",
              "--warmup=false", "--seed=0", "--checkpoint_every=2", f"--train_files={train}", f"--val_files={val}",
              f"--log_dir={logs}"]                     # float32 pinned: no note about this CPU's bf16
    p = run_trainer([*common, "--run_id=a"], tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    assert sorted(f.name for f in (logs / "a").iterdir()) == ["state_step000002.pt", "state_step000004.pt",
                                                              "state_step000005.pt"]     # the last: the final state
    newest = logs / "a" / "state_step000005.pt"
    newest.write_bytes(newest.read_bytes()[:newest.stat().st_size * 6 // 10])
    p = run_trainer([*common, f"--resume={newest}"], tmp_path)
    errors = [line for line in p.stderr.splitlines() if line.startswith("error:")]
    assert p.returncode == 2 and len(errors) == 1 and f"{newest}: truncated" in errors[0], p.stderr[-3000:]
    assert "Traceback" not in p.stderr and "bug" not in p.stderr
    p = run_trainer([*common, f"--resume={logs / 'a'}"], tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    notes = [line for line in p.stdout.splitlines() if line.startswith("note:")]
    assert len(notes) == 1 and notes[0].startswith("note: skipped state_step000005.pt: truncated"), p.stdout[-3000:]
    assert notes[0].endswith("resuming from state_step000004.pt")
    log = (logs / "a-from4.txt").read_text()
    assert notes[0] in log and re.search(r"^result: ", log, re.M)
