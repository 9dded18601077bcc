"""bench/model_step.py's options: a negative --host_profile, or --json with --optimizer, is one error line (before
anything is built)."""
import sys

from _shards import ROOT

sys.path.insert(0, str(ROOT / "bench"))
import model_step  # noqa: E402


def test_a_negative_host_profile_is_one_error_line(capsys):
    assert model_step.main(["--host", "--host_profile=-1"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err == ["error: --host_profile takes a count of functions, 0 or more, got -1"]


def test_a_times_file_of_steps_with_the_optimizer_is_refused(capsys, tmp_path):
    """bench/comm_table.py adds the optimizer to the micro-batches' times itself, so a times file must not hold it."""
    times = tmp_path / "times.json"
    assert model_step.main(["--host", "--optimizer", f"--json={times}"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("error: --json") and "drop --optimizer" in err[0]
    assert not times.exists()
