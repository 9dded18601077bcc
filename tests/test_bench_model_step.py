"""bench/model_step.py's options: a negative --host_profile is one error line (before anything is built)."""
import sys

from _shards import ROOT

sys.path.insert(0, str(ROOT / "bench"))
import model_step  # noqa: E402


def test_a_negative_host_profile_is_one_error_line(capsys):
    assert model_step.main(["--host", "--host_profile=-1"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err == ["error: --host_profile takes a count of functions, 0 or more, got -1"]
