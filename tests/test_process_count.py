"""Every resume refused for its process count says which count resumes it: a state set written by 2 processes
resumed by 4 (named or by its folder), by 1, a 1-process state resumed by 2, and a state whose recorded process count
differs from this run's (check_resume)."""
import dataclasses
from pathlib import Path

import pytest
import torch

import harness
import train_gpt as tg

WHOLE = {key: 0 for key in harness.STATE_KEYS}


def save_set(log_dir: Path, run_id: str, step: int, world_size: int) -> list[Path]:
    """One step's state as `world_size` processes write it (one file per rank, sealed for it)."""
    hp = tg.parse_args([f"--log_dir={log_dir}"])
    return [harness.Checkpointer(hp, run_id, rank, world_size, {}, lambda line: None, "code").save(
        {**WHOLE, "step": step, "model": {"w": torch.arange(100.0) + rank}}) for rank in range(world_size)]


@pytest.fixture
def every_rank_alike(monkeypatch):
    """load_checkpoint's gathers answered as if every rank saw what this one sees (no process group needed)."""
    monkeypatch.setattr(harness, "_everyone", lambda value, world_size: [value] * world_size)


@pytest.mark.parametrize("now", [4, 8])
def test_a_two_process_set_resumed_by_more_processes_says_resume_with_2(tmp_path, every_rank_alike, now):
    files = save_set(tmp_path, "run", 3, 2)
    for path in (files[0], files[1], files[0].parent):
        with pytest.raises(harness.ConfigError) as e:
            harness.load_checkpoint(str(path), 0, now)
        assert "resume with 2 processes" in str(e.value) and f"this run has {now}" in str(e.value), str(e.value)


def test_a_two_process_set_named_by_one_process_says_resume_with_2(tmp_path, every_rank_alike):
    files = save_set(tmp_path, "run", 3, 2)
    with pytest.raises(harness.ConfigError, match=r"resume with 2 processes"):
        harness.load_checkpoint(str(files[0]), 0, 1)
    with pytest.raises(harness.ConfigError, match=r"resume with 2 processes"):     # the folder: find_checkpoint's
        harness.load_checkpoint(str(files[0].parent), 0, 1)


def test_a_one_process_state_named_by_two_processes_says_resume_with_1(tmp_path, every_rank_alike):
    [path] = save_set(tmp_path, "run", 3, 1)
    with pytest.raises(harness.ConfigError, match=r"resume with 1 process\b"):
        harness.load_checkpoint(str(path), 0, 2)


def test_a_set_missing_a_rank_file_is_no_process_count_question(tmp_path, every_rank_alike):
    """A 2-process folder whose newest set lost rank 1's file: resumed by 2, the older whole set is taken, and the
    skip is said without process-count advice."""
    save_set(tmp_path, "run", 3, 2)
    newest = save_set(tmp_path, "run", 6, 2)
    newest[1].unlink()
    assert harness.writers_of(newest[0].parent, 6) == 2                  # the seal's count, not the names'
    state = harness.load_checkpoint(str(newest[0].parent), 1, 2)    # rank 1's view: its file is missing
    assert state["step"] == 3 and "processes" not in " ".join(state["notes"]), state["notes"]


def test_writers_of_reads_seals_then_names(tmp_path):
    files = save_set(tmp_path, "run", 2, 4)
    folder = files[0].parent
    assert harness.writers_of(folder, 2) == 4 and harness.writers_of(folder, 9) is None
    for f in files:                                      # states written before the seal: the names count
        f.write_bytes(b"")
    assert harness.writers_of(folder, 2) == 4


def test_check_resume_of_another_process_count_says_resume_with_it():
    hp = tg.parse_args(["--preset=tiny", "--resume=logs/r/state_step000002_rank0.pt"])
    facts = {"processes": 2, "device": "cpu", "attention backend": "sdpa", "training shards": ["a.bin"]}
    saved = {"path": "logs/r/state_step000002_rank0.pt", "hyperparameters": dataclasses.asdict(hp),
             "facts": dict(facts)}
    with pytest.raises(harness.ConfigError, match=r"resume with 2 processes; this run has 4\): NPROC=2 \./run\.sh"):
        harness.check_resume(saved, hp, dict(facts, processes=4))
